"""The supervisor: qurl-async (launcher), which process runs where (layout), what is checked before anything starts
(preflight, environment), the run folder's lock (run_folder), and the console entry points' exit codes (cli)."""
