"""HTTP plumbing both sides share: the one client session to llama-server, relaying a reply
byte for byte, request bodies as the server reads them, and OpenAI-style error bodies."""
