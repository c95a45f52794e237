-- The Projects a Worker may run Runs of (issue 21 §9), by Project ID, fixed at enrolment;
-- empty: every Project (a Worker enrolled before this migration keeps serving them all).
ALTER TABLE workers ADD COLUMN projects text[] NOT NULL DEFAULT '{}';
