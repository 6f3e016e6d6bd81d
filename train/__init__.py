"""The train stage (issue 5; see ../shared/DESIGN.md). Not built yet."""
