"""PostgreSQL adapter of the cluster control plane (psycopg 3, imported lazily: a local agent
never loads it). SQL lives only in this package."""
