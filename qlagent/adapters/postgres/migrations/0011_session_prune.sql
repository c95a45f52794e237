-- Ended Worker Sessions are pruned at hello unless a Lease names them (issue 21 §8: 20,000
-- hellos left 20,011 rows): that test needs every Lease by its Session, not only active ones.
CREATE INDEX run_leases_by_session ON run_leases(session_id);
