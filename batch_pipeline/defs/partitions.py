"""Batches are partitioned by the date they belong to (UTC)."""

import dagster as dg

# end_offset=1 makes today's partition exist, so a file uploaded today can run today.
daily_partitions = dg.DailyPartitionsDefinition(start_date="2024-01-01", timezone="UTC", end_offset=1)
