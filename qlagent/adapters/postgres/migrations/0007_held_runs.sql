-- Queued single-instance Runs held while their Task is occupied (runs.set_holds): the sweeper
-- finds a hold no live Run justifies any more (a Run ended while a concurrent Task Start saw
-- it live, or rows held by an earlier build that released holds only at the next Task Start)
-- through this index instead of scanning every Run.
CREATE INDEX runs_held ON runs(created_at_us) WHERE held AND state = 'queued';
