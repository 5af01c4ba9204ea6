"""Mixture-of-experts training (docs/moe.md): the routers' bookkeeping over a step (the tokens
each expert received, the balance loss, DeepSeek-V3's bias update) and, over `parallel.ep`,
the experts sharded with their tokens exchanged by all-to-all."""
