"""The aiohttp gateway (OpenAI API, routing, auth, limits). It never imports torch."""
