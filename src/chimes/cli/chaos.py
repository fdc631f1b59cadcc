"""``chimes chaos``: break a real fleet on purpose for a while, then check every invariant."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option("--duration", type=click.FloatRange(10), default=120.0, show_default=True,
              help="Seconds of fault injection (start-up, healing and checks come on top).")
@click.option("--seed", type=int, default=7, show_default=True,
              help="Seeds the faults and the workload: the same seed replays the same schedule of faults.")
@click.option("--database-url", envvar="CHIMES_DATABASE_URL", show_envvar=True, default=None,
              help="An empty PostgreSQL database to use instead of the harness's own embedded server "
                   "(then PostgreSQL is not restarted).")
@click.option("--ha", is_flag=True, default=False,
              help="Run on a Patroni-managed PostgreSQL of the harness's own (etcd, two servers in synchronous "
                   "mode; chimes ha) and add failovers to the faults: the primary killed, frozen past Patroni's "
                   "TTL, switched over, an etcd member killed.")
@click.option("--zones", is_flag=True, default=False,
              help="As --ha, with the cluster and the fleet spread over three zones (Linux network namespaces; "
                   "needs root and iproute2) and zone cuts among the faults: the primary's zone, or another, off "
                   "the network past Patroni's TTL and the lease TTL, then healed.")
@click.option("--zone-clock-skew", type=click.FloatRange(-30, 30), default=2.0, show_default=True,
              help="With --zones: zone 3's scheduler node and worker run this many seconds ahead of the host's "
                   "clock (behind when negative), through libfaketime.")
@click.option("--shards", type=click.IntRange(1, 16), default=1, show_default=True,
              help="PostgreSQL servers of the harness's own: the catalog and N-1 shards, the 1,024 partitions split "
                   "evenly between them (the catalog keeps the first range), and one shard's server stopped "
                   "(SIGSTOP) past the leases among the faults. Not with --database-url, --ha or --zones.")
@click.option("--moves", is_flag=True, default=False,
              help="With --shards 2 or more: during the faults, move ranges of partitions back and forth between "
                   "the homes with `chimes shards move`, some movers SIGKILLed and resumed or cancelled; the checks "
                   "read every row on the home the final map gives it.")
@click.option("--jobs", type=click.IntRange(1, 1000), default=40, show_default=True,
              help="Recurring jobs, every 1 to 5 seconds (one-off jobs are added during the run).")
@click.option("--fault-every", type=click.FloatRange(0.5), default=4.0, show_default=True,
              help="Mean seconds between faults.")
@click.option("--work-dir", type=click.Path(path_type=Path), default=None,
              help="Where logs, the target's call log and the database live (default: a temporary folder, "
                   "kept only when a violation is found).")
@click.option("--report", "report_path", type=click.Path(path_type=Path), default=None,
              help="Also write the report as JSON to this file.")
def chaos(duration: float, seed: int, database_url: str | None, ha: bool, zones: bool, zone_clock_skew: float,
          shards: int, moves: bool, jobs: int, fault_every: float, work_dir: Path | None,
          report_path: Path | None) -> None:
    """Start a fleet (PostgreSQL, 3 scheduler nodes, 3 workers, an API, an HTTP target), inject faults
    at random from the seed, then check the invariants. Exits 1 when any is violated."""
    import asyncio
    import logging
    import signal

    from chimes_chaos.harness import ChaosOptions, run_chaos

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per API call drowns the fault log

    if zones and database_url:
        raise click.UsageError("--zones starts its own cluster: it cannot be combined with --database-url")
    if shards > 1 and (database_url or ha or zones):
        given = "--database-url (or CHIMES_DATABASE_URL)" if database_url else "--zones" if zones else "--ha"
        raise click.UsageError(f"--shards starts its own embedded PostgreSQL servers: it cannot be combined "
                               f"with {given}")
    if moves and shards < 2:
        raise click.UsageError("--moves moves partitions between homes: it needs --shards 2 or more")
    options = ChaosOptions(duration=duration, seed=seed, database_url=database_url, ha=ha or zones, zones=zones,
                           zone_clock_skew=zone_clock_skew, shards=shards, moves=moves, jobs=jobs,
                           fault_every=fault_every, work_dir=work_dir)
    # SIGTERM as Ctrl-C: the run is cancelled and its fleet, cluster and zones are taken down.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    report = asyncio.run(run_chaos(options))
    click.echo(report.text())
    if report_path is not None:
        report_path.write_text(report.to_json())
    if not report.ok:
        raise SystemExit(1)
