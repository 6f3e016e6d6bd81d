"""The packing stage: stats table in, a balanced plan out (Contract 2 of ``docs/design.md``)."""
