"""The packing stage (issue 3; see ../shared/DESIGN.md). Not built yet."""
