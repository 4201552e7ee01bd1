"""The engine: sampling parameters, the jitted step, the sampler and the generation loop."""
