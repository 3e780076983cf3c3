package main

import (
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestTheProxyForwardsThePathWithItsToken(t *testing.T) {
	t.Parallel()
	type seen struct{ path, rawPath, host, auth string }
	got := make(chan seen, 1)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- seen{r.URL.Path, r.URL.RawPath, r.Host, r.Header.Get("Authorization")}
		_, _ = io.WriteString(w, "ok")
	}))
	t.Cleanup(upstream.Close)
	u, err := url.Parse(upstream.URL)
	require.NoError(t, err)
	proxy := httptest.NewServer(newProxy(u, http.DefaultTransport, "the-token", log.New(io.Discard, "", 0)))
	t.Cleanup(proxy.Close)

	req, err := http.NewRequest(http.MethodGet, proxy.URL+"/api/v1/namespaces/bench/configmaps/a%2Fb", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer the-client's")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "ok", string(body))
	require.Equal(t, seen{"/api/v1/namespaces/bench/configmaps/a/b", "/api/v1/namespaces/bench/configmaps/a%2Fb", u.Host, "Bearer the-token"}, <-got)
}
