package gateway

import (
	"net/http"
	"time"
)

// ConfigureServer sets what the lease gateway's http.Server needs beyond
// the broker's other listeners: no read or write timeout, which would cut
// a healthy watch or exec session (the API server bounds a watch itself;
// an idle connection is closed after the server's IdleTimeout), and
// HTTP/2 with a bounded number of streams and buffers per connection.
// Exported so that the bench's bare proxy, the baseline the gateway is
// measured against, serves with the same settings, not a copy of them.
func ConfigureServer(srv *http.Server) {
	srv.ReadTimeout, srv.WriteTimeout = 0, 0
	srv.HTTP2 = &http.HTTP2Config{
		MaxConcurrentStreams: DefaultMaxStreamsPerConn,
		// What a client may send before the gateway reads it: a body
		// the API server has not asked for yet waits here.
		MaxReceiveBufferPerStream:     256 << 10,
		MaxReceiveBufferPerConnection: 1 << 20,
		SendPingTimeout:               30 * time.Second,
		PingTimeout:                   15 * time.Second,
	}
}
