"""The results database: the SQLite store of every run's completions, its rows, and the file it lives in."""
