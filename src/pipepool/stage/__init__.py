"""The stage side of the step contract: what one pipeline stage does with a plan (mirror
check, packed batch, forward, pooling and heads, post-step, digest) and what it sends on."""
