"""Stage 1, read: where rows come from.

A folder of Parquet files (files.py lists them and reads their footers, schema.py checks them against
the config, source.py makes the Source: every row group with its global row offset) or one version of a
Delta or Iceberg table (tables.py, delta.py, iceberg.py, snapshot.py: the files, deletes and columns as
the format's own library reads them); row_groups.py reads one row group with its damage checks;
quality.py screens rows and accounts for every one; increments.py finds the rows a table gained since a
previous version.
"""
