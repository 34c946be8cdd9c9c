"""The primitive IR: ops, dtypes, symbolic shapes, views, graphs, kernel graphs, their protobuf form."""
