package server

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker"
)

func TestFormatExecAnswersTheBrokersExecKubeconfigAndCreatesNothing(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		accept string
	}{
		{"With Accept application/yaml the body is the kubeconfig.", apiv1.MediaTypeYAML},
		{"With JSON the kubeconfig is in the body's kubeconfig.", apiv1.MediaTypeJSON},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var gotURL string
			var got apiv1.KubeconfigRequest
			h := newHarness(t, &fakeBroker{
				exec: func(_ context.Context, _ broker.Caller, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error) {
					got, gotURL = req, brokerURL
					return []byte("kind: Config\n"), nil
				},
				issue: func(context.Context, broker.Caller, apiv1.KubeconfigRequest) (*apiv1.KubeconfigResponse, error) {
					t.Error("format=exec must issue nothing")
					return nil, nil
				},
			})
			rq := postKubeconfig(validBody)
			rq.path += "?format=exec"
			rq.accept = tc.accept
			rec := h.do(rq)
			require.Equal(t, http.StatusOK, rec.Code, rec.Body.String())
			require.Empty(t, rec.Header().Get("Location"))
			require.Equal(t, "https://broker.test", gotURL, "the plugin asks the broker where the caller reached it")
			require.Equal(t, "admiralty-source", got.ServiceAccount)
			require.Equal(t, tc.accept, rec.Header().Get("Content-Type"))
			if tc.accept == apiv1.MediaTypeYAML {
				require.Equal(t, "kind: Config\n", rec.Body.String())
				return
			}
			var resp apiv1.ExecKubeconfigResponse
			require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &resp))
			require.Equal(t, "kind: Config\n", resp.Kubeconfig)
		})
	}
}

func TestAnUnknownFormatIsRefusedBeforeTheBodyIsRead(t *testing.T) {
	t.Parallel()
	h := newHarness(t, &fakeBroker{})
	rq := postKubeconfig(validBody)
	rq.path += "?format=kubectl"
	rec := h.do(rq)
	p := requireProblem(t, rec, http.StatusBadRequest, "invalid-request")
	require.Contains(t, p.Detail+string(mustJSON(t, p.Errors)), "format")
	require.Zero(t, h.broker.calls.Load())
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}
