-- Reading the schema back from PostgreSQL's catalog (chimes.store.schema): what the migrations made,
-- without owners, grants or anything that depends on the day. Every statement is read-only.
-- Schemas of the database's own: not PostgreSQL's (pg_*, information_schema).

-- name: catalog_tables
-- Tables and partitioned tables. The day partitions of run history (runs_20261129 ...), made at run
-- time by chimes_ensure_run_partitions, are left out: only DEFAULT partitions are part of the schema.
SELECT c.oid, quote_ident(n.nspname) || '.' || quote_ident(c.relname) AS name, c.relkind::text, c.relpersistence::text,
       c.reloptions, pg_get_partkeydef(c.oid) AS partition_key,
       (SELECT quote_ident(pn.nspname) || '.' || quote_ident(p.relname)
          FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace pn ON pn.oid = p.relnamespace
         WHERE i.inhrelid = c.oid) AS parent,
       CASE WHEN c.relispartition THEN pg_get_expr(c.relpartbound, c.oid) END AS bound
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND n.nspname NOT LIKE 'pg\_%' AND n.nspname <> 'information_schema'
  AND NOT (c.relispartition AND pg_get_expr(c.relpartbound, c.oid) <> 'DEFAULT')
ORDER BY n.nspname, c.relname;

-- name: catalog_columns
-- Columns in their order (the order COPY and SELECT * use), dropped ones left out. The "char"
-- flags as text: '' when unset.
SELECT a.attrelid AS table_oid, quote_ident(a.attname) AS name, format_type(a.atttypid, a.atttypmod) AS type,
       a.attnotnull AS not_null, pg_get_expr(d.adbin, d.adrelid) AS default_expr,
       NULLIF(a.attidentity::text, '') AS identity, NULLIF(a.attgenerated::text, '') AS generated
FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = ANY($1::oid[]) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attrelid, a.attnum;

-- name: catalog_constraints
-- Constraints declared on a table, by name. NOT NULL (a constraint row of its own since PostgreSQL
-- 18) is shown on its column; a partition's copies of its parent's constraints are implied.
SELECT c.conrelid AS table_oid, quote_ident(c.conname) AS name, pg_get_constraintdef(c.oid) AS definition
FROM pg_constraint c
WHERE c.conrelid = ANY($1::oid[]) AND c.contype <> 'n' AND c.conparentid = 0
ORDER BY c.conrelid, c.conname;

-- name: catalog_indexes
-- Indexes not made by a constraint (those come with it), and not a partition's copy of its parent's.
SELECT i.indrelid AS table_oid, ic.relname AS name, pg_get_indexdef(i.indexrelid) AS definition
FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
WHERE i.indrelid = ANY($1::oid[])
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid AND c.conrelid = i.indrelid
                                                  AND c.contype IN ('p', 'u', 'x'))
  AND NOT EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = i.indexrelid)
ORDER BY ic.relname;

-- name: catalog_triggers
-- Triggers written in a migration (not PostgreSQL's own for foreign keys, nor a partition's copies).
SELECT t.tgname AS name, pg_get_triggerdef(t.oid) AS definition
FROM pg_trigger t
WHERE t.tgrelid = ANY($1::oid[]) AND NOT t.tgisinternal AND t.tgparentid = 0
ORDER BY t.tgrelid::regclass::text, t.tgname;

-- name: catalog_sequences
-- Sequences other than an identity column's (that one comes with its column).
SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) AS name, format_type(s.seqtypid, NULL) AS type,
       s.seqstart AS start, s.seqincrement AS increment, s.seqmin AS min, s.seqmax AS max, s.seqcache AS cache,
       s.seqcycle AS cycle
FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname NOT LIKE 'pg\_%' AND n.nspname <> 'information_schema'
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = c.oid AND d.classid = 'pg_class'::regclass
                                              AND d.deptype = 'i')
ORDER BY n.nspname, c.relname;

-- name: catalog_types
-- Enums and domains, with their labels or base type and checks.
SELECT quote_ident(n.nspname) || '.' || quote_ident(t.typname) AS name, t.typtype::text AS kind,
       (SELECT array_agg(quote_literal(e.enumlabel) ORDER BY e.enumsortorder) FROM pg_enum e
         WHERE e.enumtypid = t.oid) AS labels,
       format_type(t.typbasetype, t.typtypmod) AS base_type, t.typnotnull AS not_null,
       t.typdefault AS default_expr,
       (SELECT array_agg(pg_get_constraintdef(c.oid) ORDER BY c.conname) FROM pg_constraint c
         WHERE c.contypid = t.oid AND c.contype <> 'n') AS checks
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE t.typtype IN ('e', 'd') AND n.nspname NOT LIKE 'pg\_%' AND n.nspname <> 'information_schema'
ORDER BY n.nspname, t.typname;

-- name: catalog_views
SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) AS name, c.relkind::text,
       pg_get_viewdef(c.oid) AS definition
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('v', 'm') AND n.nspname NOT LIKE 'pg\_%' AND n.nspname <> 'information_schema'
ORDER BY n.nspname, c.relname;

-- name: catalog_functions
-- Functions and procedures as CREATE statements, but not an extension's.
SELECT pg_get_functiondef(p.oid) AS definition
FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
WHERE p.prokind IN ('f', 'p', 'w') AND n.nspname NOT LIKE 'pg\_%' AND n.nspname <> 'information_schema'
  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.objid = p.oid AND d.classid = 'pg_proc'::regclass
                                              AND d.deptype = 'e')
ORDER BY n.nspname, p.proname, pg_get_function_identity_arguments(p.oid);
