package client

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

// pagedBroker serves GET /v1/leases from pages, keyed by the continue
// token it expects, and records the tokens it was sent.
func pagedBroker(t *testing.T, pages map[string]apiv1.LeaseList) (*Client, func() []string) {
	t.Helper()
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token := r.URL.Query().Get("continue")
		mu.Lock()
		seen = append(seen, token)
		mu.Unlock()
		page, ok := pages[token]
		if !ok {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
		_ = json.NewEncoder(w).Encode(page)
	}))
	t.Cleanup(srv.Close)
	c, err := New(Config{URL: srv.URL, RootCAs: certPoolOf(srv)})
	require.NoError(t, err)
	c.http = srv.Client()
	return c, func() []string { mu.Lock(); defer mu.Unlock(); return append([]string(nil), seen...) }
}

func certPoolOf(srv *httptest.Server) *x509.CertPool {
	return srv.Client().Transport.(*http.Transport).TLSClientConfig.RootCAs
}

func TestLeasesFollowsTheContinueTokensToTheEnd(t *testing.T) {
	t.Parallel()
	lease := func(id string) apiv1.Lease { return apiv1.Lease{ID: id} }
	c, seen := pagedBroker(t, map[string]apiv1.LeaseList{
		"":      {Items: []apiv1.Lease{lease("a"), lease("b")}, Continue: "t+1/="},
		"t+1/=": {Items: []apiv1.Lease{}, Continue: "t2"},
		"t2":    {Items: []apiv1.Lease{lease("c")}},
	})
	got, err := c.Leases(context.Background())
	require.NoError(t, err)
	require.Equal(t, []apiv1.Lease{lease("a"), lease("b"), lease("c")}, got, "an empty page with a token is not the end")
	require.Equal(t, []string{"", "t+1/=", "t2"}, seen(), "each token sent back once, intact")
}

func TestLeasesStopsWhenTheBrokerRepeatsAToken(t *testing.T) {
	t.Parallel()
	c, seen := pagedBroker(t, map[string]apiv1.LeaseList{
		"":      {Items: []apiv1.Lease{{ID: "a"}}, Continue: "again"},
		"again": {Items: []apiv1.Lease{{ID: "a"}}, Continue: "again"},
	})
	_, err := c.Leases(context.Background())
	require.ErrorContains(t, err, "continue token it was given")
	require.Len(t, seen(), 2)
}

func TestLeasesOfNoLeasesIsAnEmptyList(t *testing.T) {
	t.Parallel()
	c, _ := pagedBroker(t, map[string]apiv1.LeaseList{"": {Items: []apiv1.Lease{}}})
	got, err := c.Leases(context.Background())
	require.NoError(t, err)
	require.NotNil(t, got)
	require.Empty(t, got)
}
