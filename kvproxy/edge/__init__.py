"""The HTTP edge: the aiohttp application clients talk to, its guards and where each route goes."""
