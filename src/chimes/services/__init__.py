"""Policy shared by the API, the dashboard and the command line, above the store: what may be
written (quotas, command tasks, sealed secrets, the first fire), which the store then writes."""
