"""The model call: request bodies, HTTP transport, retries, rate limits, the fleet, batching and answers."""
