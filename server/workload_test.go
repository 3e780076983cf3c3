package server

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
	"github.com/tokenbroker/tokenbroker/broker/workload"
	"github.com/tokenbroker/tokenbroker/pki"
)

// workloadBroker is a fakeBroker that verifies workload tokens.
type workloadBroker struct {
	*fakeBroker
	auth func(c broker.Caller, token string) (broker.Caller, error)
	put  func(c broker.Caller, doc []byte) (*apiv1.PeerJWKS, error)
	pods func(c broker.Caller, uids []string) (*apiv1.PeerLivePods, error)
	pod  func(c broker.Caller, w *pki.PodWorkload) (broker.Caller, error)
}

var _ WorkloadAuthenticator = workloadBroker{}

func (w workloadBroker) AuthenticateWorkload(_ context.Context, c broker.Caller, token string) (broker.Caller, error) {
	return w.auth(c, token)
}

func (w workloadBroker) PutPeerJWKS(_ context.Context, c broker.Caller, doc []byte) (*apiv1.PeerJWKS, error) {
	return w.put(c, doc)
}

func (w workloadBroker) ReportPeerPods(_ context.Context, c broker.Caller, uids []string) (*apiv1.PeerLivePods, error) {
	return w.pods(c, uids)
}

func (w workloadBroker) AuthenticatePodCertificate(_ context.Context, c broker.Caller, pw *pki.PodWorkload) (broker.Caller, error) {
	return w.pod(c, pw)
}

const workloadToken1 = "eyJhbGciOiJFUzI1NiJ9.d29ya2xvYWQ.c2ln"

func bearer(token string) http.Header { return http.Header{"Authorization": {"Bearer " + token}} }

func TestAWorkloadTokenIsVerifiedAfterTheCertificateAndRefusalsSayWhy(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		header     http.Header
		authErr    error
		wantStatus int
		wantReason string
		wantAuth   bool
	}{
		{name: "a verified token reaches the broker as the caller's workload", header: bearer(workloadToken1), wantStatus: http.StatusCreated, wantAuth: true},
		{name: "a refused token is 401 with the broker's reason", header: bearer(workloadToken1), authErr: workload.BadToken(pki.TokenExpired, errors.New("exp passed")), wantStatus: http.StatusUnauthorized, wantReason: pki.TokenExpired, wantAuth: true},
		{name: "a token over the size limit is refused before verification", header: bearer(strings.Repeat("a", pki.MaxWorkloadTokenBytes+1)), wantStatus: http.StatusUnauthorized, wantReason: pki.TokenTooLarge},
		{name: "another scheme than Bearer is malformed", header: http.Header{"Authorization": {"Basic " + workloadToken1}}, wantStatus: http.StatusUnauthorized, wantReason: pki.TokenMalformed},
		{name: "two Authorization headers are malformed", header: http.Header{"Authorization": {"Bearer a", "Bearer b"}}, wantStatus: http.StatusUnauthorized, wantReason: pki.TokenMalformed},
		{name: "characters a token cannot have are malformed", header: bearer("a b\"c"), wantStatus: http.StatusUnauthorized, wantReason: pki.TokenMalformed},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			fb := &fakeBroker{}
			authCalled := false
			wb := workloadBroker{fakeBroker: fb, auth: func(c broker.Caller, token string) (broker.Caller, error) {
				authCalled = true
				require.Equal(t, workloadToken1, token)
				if tc.authErr != nil {
					return c, tc.authErr
				}
				c.Workload = &workload.Identity{Namespace: "argo", ServiceAccount: "runner"}
				return c, nil
			}}
			h := newHarnessWith(t, wb)
			rq := postKubeconfig(validBody)
			rq.header = tc.header
			rec := h.do(rq)
			require.Equal(t, tc.wantStatus, rec.Code, rec.Body.String())
			require.Equal(t, tc.wantAuth, authCalled)
			if tc.wantStatus == http.StatusCreated {
				require.Equal(t, "argo/runner", fb.lastCaller().Workload.String())
				return
			}
			require.Zero(t, fb.calls.Load(), "nothing is issued for a refused token")
			var p apiv1.Problem
			require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &p))
			require.Equal(t, "urn:tokenbroker:problem:invalid-workload-token", p.Type)
			require.Equal(t, tc.wantReason, p.Reason)
			require.NotEmpty(t, p.Detail)
			require.Equal(t, `Bearer realm="tokenbroker", error="invalid_token"`, rec.Header().Get("WWW-Authenticate"))
			require.NotContains(t, rec.Body.String(), workloadToken1, "the token is never echoed")
			for _, e := range h.logs.All() {
				require.NotContains(t, e.Message+" "+strings.Join(mapValues(e.ContextMap()), " "), workloadToken1)
			}
		})
	}
}

func mapValues(m map[string]any) []string {
	out := make([]string, 0, len(m))
	for _, v := range m {
		b, _ := json.Marshal(v)
		out = append(out, string(b))
	}
	return out
}

func TestABrokerWithoutWorkloadTrustRefusesAWorkloadTokenAsNoTrust(t *testing.T) {
	t.Parallel()
	h := newHarness(t, nil)
	rq := postKubeconfig(validBody)
	rq.header = bearer(workloadToken1)
	rec := h.do(rq)
	require.Equal(t, http.StatusUnauthorized, rec.Code)
	require.Contains(t, rec.Body.String(), `"reason":"no-trust"`)
	require.Zero(t, h.broker.calls.Load())
}

func TestWhoAmIShowsTheVerifiedWorkload(t *testing.T) {
	t.Parallel()
	wb := workloadBroker{fakeBroker: &fakeBroker{}, auth: func(c broker.Caller, _ string) (broker.Caller, error) {
		c.Workload = &workload.Identity{Namespace: "argo", ServiceAccount: "runner", UID: "u-1", Pod: "p-1"}
		return c, nil
	}}
	h := newHarnessWith(t, wb)
	rec := h.do(request{method: http.MethodGet, path: "/v1/whoami", header: bearer(workloadToken1)})
	require.Equal(t, http.StatusOK, rec.Code)
	var got apiv1.WhoAmI
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &got))
	require.Equal(t, &apiv1.WorkloadInfo{Namespace: "argo", ServiceAccount: "runner", UID: "u-1", Pod: "p-1"}, got.Workload)
}

func TestAKeySetUploadIsBoundedAndForwardedAsSent(t *testing.T) {
	t.Parallel()
	const doc = `{"keys":[{"kty":"EC","kid":"k"}]}`
	tests := []struct {
		name, body, contentType string
		wantStatus              int
	}{
		{name: "a JSON key set is forwarded", body: doc, contentType: "application/json", wantStatus: http.StatusOK},
		{name: "the JWK Set media type is accepted", body: doc, contentType: "application/jwk-set+json", wantStatus: http.StatusOK},
		{name: "another media type is 415", body: doc, contentType: "text/plain", wantStatus: http.StatusUnsupportedMediaType},
		{name: "an empty body is 400", body: " ", contentType: "application/json", wantStatus: http.StatusBadRequest},
		{name: "a body over 64 KiB is 413", body: `{"keys":[],"x":"` + strings.Repeat("a", pki.MaxJWKSBytes) + `"}`, contentType: "application/json", wantStatus: http.StatusRequestEntityTooLarge},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var got []byte
			wb := workloadBroker{fakeBroker: &fakeBroker{}, put: func(_ broker.Caller, d []byte) (*apiv1.PeerJWKS, error) {
				got = d
				return &apiv1.PeerJWKS{Peer: "west", KeyIDs: []string{"k"}, Digest: "sha256:00", Changed: true}, nil
			}}
			h := newHarnessWith(t, wb, func(c *Config) { c.MaxBodyBytes = 128 << 10 })
			rec := h.do(request{method: http.MethodPut, path: "/v1/peers/self/jwks", body: tc.body, contentType: tc.contentType})
			require.Equal(t, tc.wantStatus, rec.Code, rec.Body.String())
			if tc.wantStatus == http.StatusOK {
				require.Equal(t, tc.body, string(got))
			} else {
				require.Nil(t, got, "nothing reaches the broker")
			}
		})
	}
}

func TestAKeySetUploadIsNotFoundOnABrokerWithoutWorkloadTrust(t *testing.T) {
	t.Parallel()
	h := newHarness(t, nil)
	rec := h.do(request{method: http.MethodPut, path: "/v1/peers/self/jwks", body: `{"keys":[]}`, contentType: "application/json"})
	require.Equal(t, http.StatusNotFound, rec.Code)
}

func TestALivePodsReportIsDecodedStrictlyAndForwarded(t *testing.T) {
	t.Parallel()
	const uid = "7a1e2f3c-0000-4000-8000-000000000002"
	tests := []struct {
		name, body, contentType string
		wantStatus              int
		wantUIDs                []string
	}{
		{name: "a report is forwarded", body: `{"uids":["` + uid + `"]}`, contentType: "application/json", wantStatus: http.StatusOK, wantUIDs: []string{uid}},
		{name: "no Pod lives", body: `{"uids":[]}`, contentType: "application/json", wantStatus: http.StatusOK, wantUIDs: []string{}},
		{name: "uids is required", body: `{}`, contentType: "application/json", wantStatus: http.StatusBadRequest},
		{name: "an unknown field is 400", body: `{"uids":[],"pods":[]}`, contentType: "application/json", wantStatus: http.StatusBadRequest},
		{name: "another media type is 415", body: `{"uids":[]}`, contentType: "text/plain", wantStatus: http.StatusUnsupportedMediaType},
		{name: "a body over the limit is 413", body: `{"uids":["` + strings.Repeat("a", DefaultMaxBodyBytes) + `"]}`, contentType: "application/json", wantStatus: http.StatusRequestEntityTooLarge},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var got []string
			wb := workloadBroker{fakeBroker: &fakeBroker{}, pods: func(c broker.Caller, uids []string) (*apiv1.PeerLivePods, error) {
				require.Equal(t, testIdentity, c.Identity)
				got = uids
				return &apiv1.PeerLivePods{Peer: "west", Pods: len(uids)}, nil
			}}
			h := newHarnessWith(t, wb)
			rec := h.do(request{method: http.MethodPut, path: "/v1/peers/self/pods", body: tc.body, contentType: tc.contentType})
			require.Equal(t, tc.wantStatus, rec.Code, rec.Body.String())
			require.Equal(t, tc.wantUIDs, got)
			if tc.wantStatus != http.StatusOK {
				require.Equal(t, "application/problem+json", rec.Header().Get("Content-Type"))
			}
		})
	}
	h := newHarness(t, nil)
	rec := h.do(request{method: http.MethodPut, path: "/v1/peers/self/pods", body: `{"uids":[]}`, contentType: "application/json"})
	require.Equal(t, http.StatusNotFound, rec.Code, "a broker without workload trust")
}
