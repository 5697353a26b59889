"""The tool bridge: upstream MCP tools as typed Python modules, and the broker that calls them."""
