"""The SQL store of the memory (SQLAlchemy 2: Postgres via psycopg 3, or a SQLite file)."""
