"""The engine client: the boundary between the ways in (the gRPC servicers and streams, the Python
API) and the engine. They depend only on `EngineClient` (client.py); `InProcessEngine`
(in_process.py) runs the engine on a thread of the caller's process, `EngineProcess` (process.py)
in an engine process of its own (worker.py), over a pipe whose messages are messages.py's. The
typed engine calls (calls.py) carry their arguments and run themselves on the engine's side.
"""
