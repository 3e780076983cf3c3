package client

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestAClientClosesItsIdleConnectionsAfterIdleConnTimeout(t *testing.T) {
	t.Parallel()
	closed := make(chan struct{}, 1)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{}`))
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateClosed {
			select {
			case closed <- struct{}{}:
			default:
			}
		}
	}
	srv.StartTLS()
	t.Cleanup(srv.Close)

	c, err := New(Config{URL: srv.URL, RootCAs: certPoolOf(srv), IdleConnTimeout: 50 * time.Millisecond})
	require.NoError(t, err)
	_, err = c.WhoAmI(context.Background())
	require.NoError(t, err)
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the connection was still open 10s after its request, with an idle timeout of 50ms")
	}
}

func TestAClientKeepsIdleConnectionsForNinetySecondsByDefault(t *testing.T) {
	t.Parallel()
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	t.Cleanup(srv.Close)
	c, err := New(Config{URL: srv.URL, RootCAs: certPoolOf(srv)})
	require.NoError(t, err)
	require.Equal(t, 90*time.Second, c.http.Transport.(*http.Transport).IdleConnTimeout)
}
