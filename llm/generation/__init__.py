"""Generation: the engine loop, scheduler and model runner, static batches, beams, speculation, how rows end."""
