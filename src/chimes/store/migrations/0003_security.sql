-- Security: token scopes, per-owner operator settings, and the id of the key that seals secrets.
-- See docs/security.md for what each protects against.

-- A token's scope: 'read' (GET only), 'write' (read and change its owner's jobs) or 'admin' (every
-- owner). The old boolean `admin` is kept, always equal to scope = 'admin', for readers of it.
ALTER TABLE api_tokens ADD COLUMN scope text NOT NULL DEFAULT 'write';
UPDATE api_tokens SET scope = 'admin' WHERE admin;
ALTER TABLE api_tokens
    ADD CONSTRAINT api_tokens_scope CHECK (scope IN ('read', 'write', 'admin')),
    ADD CONSTRAINT api_tokens_admin_is_scope CHECK (admin = (scope = 'admin'));

-- What the operator allows each owner (team), read by the API (quota, command tasks) and by the
-- workers (command tasks, signing). A missing row means the defaults: no command tasks, the API's
-- default job quota, and a signing secret made on first use.
CREATE TABLE owners (
    owner          text PRIMARY KEY,
    allow_commands boolean NOT NULL DEFAULT false,
    job_quota      integer CHECK (job_quota >= 0),   -- NULL: the API's default quota
    signing_secret text,                              -- sealed (Fernet) with the secret key
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- The id (not the key) of the secret key the sealed values in this database were made with, so a
-- process started with another key fails at start-up instead of failing every run.
CREATE TABLE secret_key (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key_id     text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
