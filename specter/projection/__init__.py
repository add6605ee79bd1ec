"""Projection of the engine's schedule onto a modelled device: a virtual clock and a roofline cost model."""
