"""Each llama-server as the cache knows it: its slots, who may touch them, how it answers.

The server (backend.py), what each of its slots holds (slots.py), who may touch a slot now and
the wait for one (slotpool.py), work that holds slots to its end (leases.py), a server found
hung (liveness.py), the LoRA scales of its namespaces (loras.py), and how fast it saves,
restores and replies (pace.py). Talking to llama-server is the server package's.
"""
