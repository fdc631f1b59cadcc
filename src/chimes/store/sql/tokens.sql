-- name: insert_token
INSERT INTO api_tokens (token_id, token_hash, owner, scope, admin, name) VALUES ($1, $2, $3, $4, $4 = 'admin', $5);

-- name: token_by_hash
SELECT token_id, owner, admin, scope, name FROM api_tokens WHERE token_hash = $1 AND revoked_at IS NULL;

-- name: list_tokens
SELECT token_id, owner, admin, scope, name, created_at, revoked_at FROM api_tokens ORDER BY created_at;

-- name: revoke_token
UPDATE api_tokens SET revoked_at = now() WHERE token_id = $1 AND revoked_at IS NULL RETURNING token_id;

-- name: lock_api_tokens
-- Taken before count_admin_tokens on a first start: two processes starting together make one admin
-- token between them, not two.
LOCK TABLE api_tokens IN SHARE ROW EXCLUSIVE MODE;

-- name: count_admin_tokens
SELECT count(*) FROM api_tokens WHERE admin AND revoked_at IS NULL;
