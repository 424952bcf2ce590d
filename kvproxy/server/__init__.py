"""The llama-server side: its typed API, discovery and model identity, and managed mode
(starting, watching and stopping a server, and what its start-up failures mean)."""
