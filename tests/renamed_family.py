"""A model family defined outside ``vlmshard.families``: a renamed copy of InternVL that takes over
its ``model_type``. ``tests/test_new_family.py`` names this module in ``VLMSHARD_FAMILIES``, so
every process of every stage registers it, as a user's own family would be."""

from vlmshard.families import register
from vlmshard.families.internvl import InternVL


class RenamedInternVL(InternVL):
    name = "renamed_internvl"


register(RenamedInternVL())
