-- Each process records the release it runs, so that an upgrade can see which releases are live
-- (`chimes migrate --plan`) and a contract step waits until none older is (docs/operations.md,
-- "Upgrades"). An expand step: processes of release 0.1.0 leave `release` NULL ("0.1.0 or earlier")
-- and never read `api_servers`.
ALTER TABLE scheduler_nodes ADD COLUMN release text;
ALTER TABLE workers ADD COLUMN release text;

-- API servers heartbeat here (on the catalog) as scheduler nodes and workers do on every home.
CREATE TABLE api_servers (
    server_id    text PRIMARY KEY,
    hostname     text NOT NULL,
    pid          integer NOT NULL,
    release      text NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
