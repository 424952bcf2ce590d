"""Which server a request goes to: lanes (one llama-server, or one model of a router), the
dispatch among them, router-mode models, discovery, and what the stats show of each."""
