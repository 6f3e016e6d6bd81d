"""The shards stage (issue 4; see ../shared/DESIGN.md). Not built yet."""
