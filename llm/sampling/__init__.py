"""How a token is chosen: the request's settings, the sampler chain, picks, grammar masks, constrained formats."""
