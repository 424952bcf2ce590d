"""One request on the server its lane chose: the keyed driver, getting the state ready
(prepare, on plain data in plan), the requests the cache does not key, and the answers
kvproxy gives itself."""
