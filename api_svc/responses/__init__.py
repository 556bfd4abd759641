"""OpenAI's Responses API (/v1/responses): the routes, the request, the response as it forms, the Redis store."""
