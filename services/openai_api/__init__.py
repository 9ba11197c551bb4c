"""The OpenAI HTTP kit shared by the router and every replica: request bodies, prompt preparation,
error objects, stream plumbing, uvicorn serving and the routes both faces expose. Imports no torch and
nothing of the scheduler or the engine."""
