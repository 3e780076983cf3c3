package integration

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestAWatchThroughTheGatewayIsOnTheRecordWhileItRunsAndWhenItEnds is
// what a user tried: `kubectl get cm -w` through a gateway kubeconfig,
// ended after a while, left one gateway_request for the list and none for
// the watch, nor any count in the duration metric. Now the watch is
// audited when it is forwarded, with the id the API server's audit log
// records, and again when it ends, whether its client ends it or the
// revocation does; the metrics count both.
func TestAWatchThroughTheGatewayIsOnTheRecordWhileItRunsAndWhenItEnds(t *testing.T) {
	s, west := setUpGateway(t)
	kubectl, err := testcluster.Binary(context.Background(), "", testcluster.Kubectl)
	require.NoError(t, err)
	resp := issue(t, s, west, apiv1.KubeconfigRequest{Namespace: "argo", ServiceAccount: "runner"})
	kubeconfig := filepath.Join(t.TempDir(), "gateway.kubeconfig")
	require.NoError(t, os.WriteFile(kubeconfig, []byte(resp.Kubeconfig), 0o600))

	watches := func() (forwards, ends []map[string]any) {
		for _, ev := range readAudit(t, s.auditLog) {
			path, _ := ev["path"].(string)
			if ev["lease_id"] != resp.LeaseID || !strings.Contains(path, "/configmaps") {
				continue
			}
			switch ev["action"] {
			case "gateway_forward":
				forwards = append(forwards, ev)
			case "gateway_request":
				if ev["status"] == float64(http.StatusOK) && ev["reason"] != nil {
					ends = append(ends, ev) // a watch ends with a reason; a list by itself
				}
			}
		}
		return forwards, ends
	}
	create := func(name string) {
		t.Helper()
		_, err := s.cluster.Client.CoreV1().ConfigMaps("argo").Create(context.Background(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	// kubectl get -w: the list, then the watch; it prints "listed" once the
	// list is in.
	create("listed")
	// startWatch runs kubectl get -w and returns once its watch is open
	// at the API server: an object created after its gateway_forward is
	// printed. (Revoking before the API server answered the watch would end
	// a request that never became a watch.)
	startWatch := func(n int) *exec.Cmd {
		t.Helper()
		cmd := exec.Command(kubectl, "--kubeconfig", kubeconfig, "-n", "argo", "get", "configmaps", "-w", "--no-headers", "-o", "name")
		out, err := cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		printed := make(chan string, 64)
		go func() {
			lines := bufio.NewScanner(out)
			for lines.Scan() {
				printed <- lines.Text()
			}
			close(printed)
		}()
		await := func(name string) {
			t.Helper()
			deadline := time.After(20 * time.Second)
			for {
				select {
				case line, ok := <-printed:
					require.True(t, ok, "kubectl ended before it printed %s", name)
					if line == "configmap/"+name {
						return
					}
				case <-deadline:
					t.Fatalf("kubectl printed no %s through the gateway", name)
				}
			}
		}
		await("listed")
		require.Eventually(t, func() bool { f, _ := watches(); return len(f) >= n }, 10*time.Second, 20*time.Millisecond)
		name := fmt.Sprintf("watched-%d", n)
		create(name)
		await(name)
		return cmd
	}

	// Ended by its client.
	cmd := startWatch(1)
	forwards, ends := watches()
	require.Len(t, forwards, 1, "the watch is on the record while it runs")
	require.Empty(t, ends)
	require.NotEmpty(t, forwards[0]["api_audit_id"])
	require.Equal(t, 1.0, s.gauge(t, "tokenbroker_gateway_requests_in_flight"))
	require.NoError(t, cmd.Process.Signal(syscall.SIGINT))
	_ = cmd.Wait()
	require.Eventually(t, func() bool { _, e := watches(); return len(e) == 1 }, 10*time.Second, 20*time.Millisecond)
	_, ends = watches()
	require.Equal(t, forwards[0]["api_audit_id"], ends[0]["api_audit_id"], "one request, forwarded and ended")
	require.Equal(t, "client_gone", ends[0]["reason"])
	require.Eventually(t, func() bool { return s.gauge(t, "tokenbroker_gateway_requests_in_flight") == 0 }, 5*time.Second, 20*time.Millisecond)

	// Ended by the revocation.
	startWatch(2)
	forwards, _ = watches()
	require.Len(t, forwards, 2)
	status, body := do(t, west, http.MethodDelete, s.url+"/v1/leases/"+resp.LeaseID, nil, nil)
	require.Equal(t, http.StatusNoContent, status, string(body))
	require.Eventually(t, func() bool { _, e := watches(); return len(e) == 2 }, 10*time.Second, 20*time.Millisecond)
	_, ends = watches()
	require.Equal(t, "revoked", ends[1]["reason"])

	// Every request of the lease is in the duration histogram: the lists,
	// the watches, and whatever kubectl asked besides.
	require.Eventually(t, func() bool {
		var requests int
		for _, ev := range readAudit(t, s.auditLog) {
			if ev["lease_id"] == resp.LeaseID && ev["action"] == "gateway_request" {
				requests++
			}
		}
		return float64(requests) == s.histogramCount(t, "tokenbroker_gateway_request_duration_seconds")
	}, 5*time.Second, 20*time.Millisecond)
}

// gauge is the sum of the broker's gauge name over its labels.
func (s *stack) gauge(t *testing.T, name string) float64 {
	return s.metricSum(t, name, func(m *dto.Metric) float64 { return m.GetGauge().GetValue() })
}

// histogramCount is the count of the broker's histogram name.
func (s *stack) histogramCount(t *testing.T, name string) float64 {
	return s.metricSum(t, name, func(m *dto.Metric) float64 { return float64(m.GetHistogram().GetSampleCount()) })
}

// metricSum sums value over the series of the broker's metric name.
func (s *stack) metricSum(t *testing.T, name string, value func(*dto.Metric) float64) float64 {
	t.Helper()
	mfs, err := s.reg.Gather()
	require.NoError(t, err)
	total := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				total += value(m)
			}
		}
	}
	return total
}
