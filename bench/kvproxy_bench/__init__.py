"""`kvproxy bench`: the same work run side by side through kvproxy, llama-server's own RAM
prompt cache and no cache at all. Every speed claim in the README comes from here."""
