package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/tokenbroker/tokenbroker/test/testcluster"
)

// TestClientGoPicksUpATokenFileTheAgentRotates runs the agent with a token
// file output (a 10-minute token refreshed after 12 s, the old lease
// revoked 2 s later, far shorter than a real revokeGrace) and one client
// built once with client-go's own loader from the kubeconfig file, as a
// sidecar's consumer builds it. After the lease its first token came from
// is revoked and refused by the API server, the same client works again
// within a minute: client-go re-reads the token file, no restart.
func TestClientGoPicksUpATokenFileTheAgentRotates(t *testing.T) {
	c := testcluster.Start(t)
	ctx := context.Background()
	setUpTarget(t, c)
	e := startBroker(t, c)
	out := t.TempDir()
	kubeconfig := filepath.Join(out, "kubeconfig")
	config := writeFile(t, filepath.Join(t.TempDir(), "agent.yaml"), fmt.Sprintf(`identity: {dir: %s}
refresh: {fraction: 0.02, jitter: 0, revokeGrace: 2s}
targets:
  - name: east
    broker: https://%s
    request: {namespace: argo, serviceAccount: runner, ttl: 10m}
    outputs:
      - file: {path: %s, tokenFile: token}
opsAddress: "127.0.0.1:%d"
`, westIdentityDir(t, e), e.api, kubeconfig, freePort(t)))
	a := startAgent(t, config)
	a.waitReady(t)

	kc, err := os.ReadFile(kubeconfig)
	require.NoError(t, err)
	require.Contains(t, string(kc), "tokenFile: token")
	first, err := os.ReadFile(filepath.Join(out, "token"))
	require.NoError(t, err)
	kcInfo, err := os.Stat(kubeconfig)
	require.NoError(t, err)

	// The consumer: built once, from the file, by client-go.
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	require.NoError(t, err)
	consumer, err := kubernetes.NewForConfig(rc)
	require.NoError(t, err)
	list := func(cs kubernetes.Interface) error {
		_, err := cs.CoreV1().ConfigMaps("argo").List(ctx, metav1.ListOptions{})
		return err
	}
	require.NoError(t, list(consumer))

	// Only the first token, as a client that never re-reads would hold it.
	staticCfg := c.TokenConfig(strings.TrimSpace(string(first)))
	static, err := kubernetes.NewForConfig(staticCfg)
	require.NoError(t, err)
	start := time.Now()
	for list(static) == nil {
		require.Less(t, time.Since(start), 90*time.Second, "the first token was never revoked")
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("the first token was refused %s after the agent was ready", time.Since(start).Round(time.Second))

	// The consumer, built once, works again at client-go's next re-read
	// of the file (every minute, less 10 s of leeway; not at a 401: a
	// rest.Config's BearerTokenFile has no reset on 401).
	refusedAt := time.Now()
	for {
		err := list(consumer)
		if err == nil {
			break
		}
		require.Less(t, time.Since(refusedAt), 65*time.Second, "client-go never picked up the rotated token: %v", err)
		time.Sleep(250 * time.Millisecond)
	}
	t.Logf("the consumer used the rotated token %s after the first one was refused", time.Since(refusedAt).Round(time.Second))

	now, err := os.ReadFile(filepath.Join(out, "token"))
	require.NoError(t, err)
	require.NotEqual(t, string(first), string(now), "the agent rotated the token")
	after, err := os.Stat(kubeconfig)
	require.NoError(t, err)
	require.True(t, kcInfo.ModTime().Equal(after.ModTime()), "the kubeconfig was not rewritten for new tokens")
}
