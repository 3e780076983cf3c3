package execcred

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/clock"
)

// The environment of the test binary when it runs as the plugin.
const (
	pluginEnv       = "EXECCRED_TEST_PLUGIN"
	pluginCacheEnv  = "EXECCRED_TEST_CACHE_DIR"
	pluginBrokerEnv = "EXECCRED_TEST_BROKER"
)

// TestMain lets the test binary be the plugin, run by client-go's own exec
// authenticator or by the tests as separate processes: a plugin with this
// package's cache, exec info and parent detection, whose broker is a
// plain-HTTP stand-in in the test process.
func TestMain(m *testing.M) {
	if os.Getenv(pluginEnv) == "1" {
		os.Exit(pluginMain())
	}
	os.Exit(m.Run())
}

func pluginMain() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "test plugin:", err)
		return 1
	}
	info, err := ExecInfoFromEnv(os.LookupEnv)
	if err != nil {
		return fail(err)
	}
	cache, err := OpenCache(os.Getenv(pluginCacheEnv))
	if err != nil {
		return fail(err)
	}
	var parent Parent
	if info.FromClientGo {
		parent = ParentOf("/proc", os.Getppid())
	}
	broker := os.Getenv(pluginBrokerEnv)
	p := &Plugin{Clock: clock.RealClock{}, Cache: cache}
	cred, _, err := p.Get(context.Background(), Key{Broker: broker, Namespace: "argo", ServiceAccount: "runner"}, parent,
		func(ctx context.Context) (*Credential, error) {
			resp, err := http.Post(broker, "", nil)
			if err != nil {
				return nil, err
			}
			defer resp.Body.Close()
			var c Credential
			return &c, json.NewDecoder(resp.Body).Decode(&c)
		})
	if err != nil {
		return fail(err)
	}
	out, err := Encode(info.APIVersion, cred.Status())
	if err != nil {
		return fail(err)
	}
	_, _ = os.Stdout.Write(out)
	return 0
}

// processBroker is the stand-in broker of the plugin processes, and the
// API server's list of valid tokens.
type processBroker struct {
	mu    sync.Mutex
	n     int
	valid map[string]bool
}

func (b *processBroker) ServeHTTP(w http.ResponseWriter, _ *http.Request) {
	b.mu.Lock()
	b.n++
	tok := fmt.Sprintf("token-%d", b.n)
	b.valid[tok] = true
	n := b.n
	b.mu.Unlock()
	now := time.Now()
	_ = json.NewEncoder(w).Encode(Credential{LeaseID: leaseID(n), Token: tok, ObtainedAt: now, ExpiresAt: now.Add(time.Hour)})
}

func (b *processBroker) issued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n
}

func (b *processBroker) revoke(tok string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.valid, tok)
}

func (b *processBroker) authenticate(r *http.Request) (string, bool) {
	tok := strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer ")
	b.mu.Lock()
	defer b.mu.Unlock()
	return tok, b.valid[tok]
}

func newProcessBroker(t *testing.T) (*processBroker, string) {
	t.Helper()
	b := &processBroker{valid: map[string]bool{}}
	srv := httptest.NewServer(b)
	t.Cleanup(srv.Close)
	return b, srv.URL
}

func pluginEnvironment(t *testing.T, brokerURL string) []string {
	t.Helper()
	return []string{pluginEnv + "=1", pluginCacheEnv + "=" + filepath.Join(t.TempDir(), "cache"), pluginBrokerEnv + "=" + brokerURL}
}

// TestClientGoRunsThePluginAgainAfterA401AndGetsAFreshCredential drives
// the plugin through client-go's own exec authenticator (rest.TransportFor
// with an ExecProvider), against an API server stand-in that answers 401
// to a revoked token: client-go runs the plugin again in the same process,
// the plugin recognises its parent and drops the refused credential.
func TestClientGoRunsThePluginAgainAfterA401AndGetsAFreshCredential(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("needs /proc to know the parent")
	}
	broker, brokerURL := newProcessBroker(t)
	var seen []string
	var mu sync.Mutex
	api := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tok, ok := broker.authenticate(r)
		mu.Lock()
		seen = append(seen, tok)
		mu.Unlock()
		if !ok {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		_, _ = w.Write([]byte("{}"))
	}))
	t.Cleanup(api.Close)
	var env []clientcmdapi.ExecEnvVar
	for _, kv := range pluginEnvironment(t, brokerURL) {
		k, v, _ := strings.Cut(kv, "=")
		env = append(env, clientcmdapi.ExecEnvVar{Name: k, Value: v})
	}
	rt, err := rest.TransportFor(&rest.Config{
		Host:            api.URL,
		TLSClientConfig: rest.TLSClientConfig{CAData: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: api.Certificate().Raw})},
		ExecProvider: &clientcmdapi.ExecConfig{
			APIVersion: APIVersionV1, Command: os.Args[0], Env: env,
			InteractiveMode: clientcmdapi.NeverExecInteractiveMode,
		},
	})
	require.NoError(t, err)
	hc := &http.Client{Transport: rt}
	get := func() int {
		resp, err := hc.Get(api.URL + "/api")
		require.NoError(t, err)
		resp.Body.Close()
		return resp.StatusCode
	}

	require.Equal(t, http.StatusOK, get())
	require.Equal(t, http.StatusOK, get())
	require.Equal(t, 1, broker.issued(), "client-go keeps the credential until its expiration")

	broker.revoke("token-1")
	require.Equal(t, http.StatusUnauthorized, get(), "the request that meets the revocation fails")
	require.Equal(t, 2, broker.issued(), "client-go ran the plugin again, and it did not hand out the refused token")
	require.Equal(t, http.StatusOK, get(), "the next request works")
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"token-1", "token-1", "token-1", "token-2"}, seen)
}

// TestParallelPluginProcessesMakeOneIssuance runs the plugin as separate
// processes at once, each under its own shell as each kubectl would be,
// with client-go's request in KUBERNETES_EXEC_INFO: the file lock lets one
// of them issue and the others read its cache file.
func TestParallelPluginProcessesMakeOneIssuance(t *testing.T) {
	t.Parallel()
	broker, brokerURL := newProcessBroker(t)
	env := slices.Concat(os.Environ(), pluginEnvironment(t, brokerURL))
	const n = 12
	outs := make([][]byte, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	version := func(i int) string {
		if i%2 == 1 {
			return APIVersionV1beta1
		}
		return APIVersionV1
	}
	for i := range n {
		wg.Go(func() {
			// "; exit" keeps the shell from exec'ing the plugin: each
			// plugin process has a parent of its own, as under kubectl.
			cmd := exec.Command("sh", "-c", `"$0"; exit $?`, os.Args[0])
			cmd.Env = slices.Concat(env, []string{ExecInfoEnv + `={"kind":"ExecCredential","apiVersion":"` + version(i) + `","spec":{"interactive":false}}`})
			var stderr strings.Builder
			cmd.Stderr = &stderr
			outs[i], errs[i] = cmd.Output()
			if errs[i] != nil {
				errs[i] = fmt.Errorf("%w: %s", errs[i], stderr.String())
			}
		})
	}
	wg.Wait()
	for i := range n {
		require.NoError(t, errs[i])
		cred := decodeLikeClientGo(t, version(i), outs[i])
		require.Equal(t, "token-1", cred.Status.Token)
	}
	require.Equal(t, 1, broker.issued())
}
