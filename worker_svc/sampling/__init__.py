"""From logits to what a step returns: the sampler, structured-output grammars, prompt logprobs, pooling."""
