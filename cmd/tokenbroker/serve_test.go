package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
)

// serveConfigOf parses args like "tokenbroker serve" would, without running.
func serveConfigOf(t *testing.T, args ...string) (serveConfig, error) {
	t.Helper()
	var got serveConfig
	var gotErr error
	cmd := newServeCommand()
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		v, err := newViper(cmd)
		if err != nil {
			gotErr = err
			return nil
		}
		got, gotErr = serveConfigFrom(v)
		return nil
	}
	cmd.SetArgs(args)
	cmd.SetOut(new(strings.Builder))
	cmd.SetErr(new(strings.Builder))
	require.NoError(t, cmd.Execute())
	return got, gotErr
}

var required = []string{"--tls-cert-file", "c", "--tls-key-file", "k", "--client-ca-file", "ca", "--policy-file", "p"}

func TestServeDefaultsSuitABroker(t *testing.T) {
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Equal(t, ":8443", cfg.ListenAddress)
	require.Equal(t, ":9090", cfg.OpsAddress)
	// Far above client-go's 5 QPS / burst 10, which would cap issuance.
	require.Equal(t, float32(2000), cfg.KubeQPS)
	require.Equal(t, 4000, cfg.KubeBurst)
	require.Equal(t, time.Minute, cfg.GCInterval)
	require.Equal(t, []string{"token"}, cfg.Credentials)
	require.Equal(t, "json", cfg.Log.Format)

}

func TestOneKubeconfigLoaderWithKubectlsRules(t *testing.T) {
	explicit := writeKubeconfig(t)
	rc, err := restConfig(explicit, "")
	require.NoError(t, err)
	require.Equal(t, "https://127.0.0.1:1", rc.Host)
	require.Equal(t, "x", rc.BearerToken)

	// Without --kubeconfig, $KUBECONFIG is read, as kubectl reads it.
	t.Setenv("KUBECONFIG", explicit)
	rc, err = restConfig("", "")
	require.NoError(t, err)
	require.Equal(t, "https://127.0.0.1:1", rc.Host)

	_, err = restConfig(explicit, "no-such-context")
	require.ErrorContains(t, err, "no-such-context")
}

func TestServeReportsEveryMissingFlag(t *testing.T) {
	_, err := serveConfigOf(t)
	require.Error(t, err)
	for _, f := range []string{"--tls-cert-file", "--tls-key-file", "--client-ca-file", "--policy-file"} {
		require.Contains(t, err.Error(), f)
	}
}

func TestFlagsBeatEnvironmentWhichBeatsTheConfigFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "serve.yaml")
	require.NoError(t, os.WriteFile(file, []byte("kube-qps: 50\nkube-burst: 60\nops-address: 127.0.0.1:1\n"), 0o600))
	t.Setenv("TOKENBROKER_KUBE_BURST", "70")
	t.Setenv("TOKENBROKER_OPS_ADDRESS", "127.0.0.1:2")
	cfg, err := serveConfigOf(t, append(required, "--config", file, "--ops-address", "127.0.0.1:3")...)
	require.NoError(t, err)
	require.Equal(t, float32(50), cfg.KubeQPS, "from the file")
	require.Equal(t, 70, cfg.KubeBurst, "environment over file")
	require.Equal(t, "127.0.0.1:3", cfg.OpsAddress, "flag over environment")
}

func TestAConfigFileWithAnUnknownKeyIsRejected(t *testing.T) {
	file := filepath.Join(t.TempDir(), "serve.yaml")
	require.NoError(t, os.WriteFile(file, []byte("kube-qsp: 50\n"), 0o600))
	_, err := serveConfigOf(t, append(required, "--config", file)...)
	require.ErrorContains(t, err, `unknown key "kube-qsp"`)
}

func TestBadValuesAreRefused(t *testing.T) {
	for _, args := range [][]string{{"--kube-qps", "0"}, {"--gc-interval", "1ms"}, {"--max-body-bytes", "-1"}, {"--max-conns-per-ip", "-1"}, {"--max-conns-per-identity", "-1"},
		{"--max-conns", "-1"}, {"--max-handshakes", "-1"}, {"--max-handshakes-per-ip", "-1"}, {"--handshake-timeout", "5s"}, {"--handshake-timeout", "-1s"}} {
		_, err := serveConfigOf(t, append(required, args...)...)
		require.Error(t, err, args)
	}
}

func writeKubeconfig(t *testing.T) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kubeconfig")
	require.NoError(t, os.WriteFile(p, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: x}}]
contexts: [{name: c, context: {cluster: c, user: u}}]
current-context: c
`), 0o600))
	return p
}

func TestServeCertificateFlags(t *testing.T) {
	t.Setenv("POD_NAMESPACE", "")
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Empty(t, cfg.EnrollAddress, "enrollment is off unless asked for")
	require.Empty(t, cfg.CACertFile)
	require.Equal(t, 24*time.Hour, cfg.ClientCertTTL)
	require.Equal(t, "tokenbroker", cfg.Namespace)
	require.False(t, cfg.SignClusterCAs, "cluster CAs are signed only when asked for")

	cfg, err = serveConfigOf(t, append(required, "--ca-cert-file", "ca.crt", "--ca-key-file", "ca.key",
		"--enroll-address", ":8444", "--client-cert-ttl", "2h", "--sign-cluster-cas")...)
	require.NoError(t, err)
	require.Equal(t, ":8444", cfg.EnrollAddress)
	require.Equal(t, 2*time.Hour, cfg.ClientCertTTL)
	require.True(t, cfg.SignClusterCAs)
}

func TestTheNamespaceComesFromTheFlagThenThePod(t *testing.T) {
	t.Setenv("POD_NAMESPACE", "from-pod")
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Equal(t, "from-pod", cfg.Namespace)
	cfg, err = serveConfigOf(t, append(required, "--namespace", "from-flag")...)
	require.NoError(t, err)
	require.Equal(t, "from-flag", cfg.Namespace)
}

func TestBadCertificateFlagsAreRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--enroll-address", ":8444"}, "--enroll-address needs --ca-cert-file"},
		{[]string{"--ca-cert-file", "ca.crt"}, "go together"},
		{[]string{"--ca-key-file", "ca.key"}, "go together"},
		{[]string{"--client-cert-ttl", "1m"}, "--client-cert-ttl"},
		{[]string{"--client-cert-ttl", "1000h"}, "--client-cert-ttl"},
		{[]string{"--namespace", "Not_A_Namespace"}, "--namespace"},
		{[]string{"--previous-ca-cert-file", "old.crt"}, "--previous-ca-cert-file needs --ca-cert-file"},
		{[]string{"--sign-cluster-cas"}, "--sign-cluster-cas needs --ca-cert-file"},
		{[]string{"--broker-name", "east west"}, "--broker-name: audience \"east west\": only printable ASCII without spaces or commas"},
		{[]string{"--publish-cluster-trust-bundle", "east"}, "--publish-cluster-trust-bundle: signer name \"east\""},
		{[]string{"--broker-name", "tokenbroker-enrollment"}, "--broker-name: audience \"tokenbroker-enrollment\" is the mark of an unbound token"},
	} {
		_, err := serveConfigOf(t, append(required, tc.args...)...)
		require.ErrorContains(t, err, tc.want, tc.args)
	}
}

func TestTheAuditLogGoesToStdoutByDefaultAndCannotBeTurnedOff(t *testing.T) {
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Equal(t, "stdout", cfg.AuditLog)
	_, err = serveConfigOf(t, append([]string{"--audit-log", ""}, required...)...)
	require.ErrorContains(t, err, "--audit-log")
}

func TestPublishingAClusterTrustBundleIsOffByDefaultAndTakesASignerName(t *testing.T) {
	cfg, err := serveConfigOf(t, required...)
	require.NoError(t, err)
	require.Empty(t, cfg.PublishClusterTrustBundle)
	cfg, err = serveConfigOf(t, append([]string{"--publish-cluster-trust-bundle", "tokenbroker.io/east"}, required...)...)
	require.NoError(t, err)
	require.Equal(t, "tokenbroker.io/east", cfg.PublishClusterTrustBundle)
}

func TestAnUnknownCredentialKindIsRefusedBeforeStart(t *testing.T) {
	_, err := serveConfigOf(t, append([]string{"--credentials", "token,x509"}, required...)...)
	require.ErrorContains(t, err, `unknown or unsupported credential kind "x509"`)
	_, err = serveConfigOf(t, append([]string{"--credentials", "token,clientCertificate"}, required...)...)
	require.NoError(t, err, "both kinds exist")
}
