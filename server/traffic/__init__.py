"""Traffic control: API keys and tenants, rate limits (in process or shared through Redis),
admission to engine slots with a bounded queue, the server's lifecycle and the process runner.
The ASGI middlewares that apply them live in server/api/."""
