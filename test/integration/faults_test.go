package integration

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
)

func TestAnUnavailableAPIServerIsA503AndLeavesNothingBehind(t *testing.T) {
	s, west := setUp(t)
	issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	before := len(leaseSecrets(t, s.cluster.Client))

	require.NoError(t, s.cluster.StopAPIServer())
	req, err := http.NewRequest(http.MethodPost, s.url+"/v1/kubeconfigs", jsonBody(t, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"}))
	require.NoError(t, err)
	req.Header.Set("Content-Type", apiv1.MediaTypeJSON)
	resp, err := west.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Equal(t, apiv1.MediaTypeProblem, resp.Header.Get("Content-Type"))
	require.NotEmpty(t, resp.Header.Get("Retry-After"))
	var p apiv1.Problem
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&p))
	require.Equal(t, http.StatusServiceUnavailable, p.Status)
	require.Error(t, s.broker.Ready(context.Background()), "not ready while the API server is down")

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, s.cluster.StartAPIServer(ctx))
	require.NoError(t, s.broker.Ready(ctx))
	// Recovered without a restart, and the failed request left no lease.
	require.Len(t, leaseSecrets(t, s.cluster.Client), before)
	issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
}
