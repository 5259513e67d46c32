"""The gRPC edge: servicers that convert protobuf to domain types and back, and the server itself."""
