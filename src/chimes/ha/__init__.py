"""A highly available PostgreSQL for Chimes on one machine: etcd and Patroni, started by Chimes.

What production runs on several hosts (docs/high-availability.md), started here as processes on one
host, so that a failover can be tried, tested and measured: ``chimes ha up``, the HA tests and the
chaos harness's failover faults all use :class:`chimes.ha.cluster.HaCluster`.
"""
