"""The MCP face: `codecage serve`'s tools over stdio and streamable HTTP."""
