"""Tier 3: interoperability with pyverbs, an independent verbs implementation, as the peer."""
