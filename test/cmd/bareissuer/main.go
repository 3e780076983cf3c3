// Command bareissuer is the baseline the bench measures the broker's token
// issuance against: a service in front of the API server that makes, per
// request, exactly the calls of the direct pair (a Secret, then a
// TokenRequest bound to it) and does nothing else.
//
// Like the broker's API it listens with the broker's mutual TLS profile
// (pki.ServerTLSConfig: TLS 1.3, a client certificate verified against
// -client-ca-file, HTTP/2 offered), serves with the broker's http.Server
// settings, takes POST /v1/kubeconfigs with a KubeconfigRequest body and
// answers 201 with a KubeconfigResponse holding the token, and calls the
// API server with a client built as the broker builds its own (protobuf,
// no gzip, the client-side limit lifted). Unlike it, it decides nothing
// (no policy, limits, lease, audit, metrics or kubeconfig): what the
// broker costs beyond it is what those cost, and what it costs beyond the
// direct pair is a service hop itself on the same cores.
//
// It is built and started by test/cmd/bench, one process beside the
// broker's, so that the CPU of each is its own.
package main

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
	"github.com/tokenbroker/tokenbroker/server"
	"github.com/tokenbroker/tokenbroker/test/cmd/internal/baselinesrv"
)

// config is what the command line asks for.
type config struct {
	baselinesrv.Flags
	kubeconfig string
	qps        float64
	burst      int
}

func main() {
	var cfg config
	cfg.Register(flag.CommandLine, "certificates")
	flag.StringVar(&cfg.kubeconfig, "kubeconfig", "", "kubeconfig of the API server, whose credentials create the Secrets and tokens")
	flag.Float64Var(&cfg.qps, "kube-qps", 2000, "client-side rate limit of the Kubernetes client, as the broker's --kube-qps")
	flag.IntVar(&cfg.burst, "kube-burst", 4000, "client-side burst of the Kubernetes client, as the broker's --kube-burst")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "bareissuer:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	if cfg.kubeconfig == "" || cfg.Missing() {
		return errors.New("-kubeconfig, -tls-cert-file, -tls-key-file and -client-ca-file are required")
	}
	rc, err := clientcmd.BuildConfigFromFlags("", cfg.kubeconfig)
	if err != nil {
		return fmt.Errorf("load -kubeconfig: %w", err)
	}
	rc = rest.CopyConfig(rc)
	server.TuneKubeClient(rc, float32(cfg.qps), cfg.burst)
	rc.UserAgent = "tokenbroker-bench/bareissuer"
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	certs, roots, err := cfg.LoadTLS()
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	tlsCfg := pki.ServerTLSConfig(certs, roots)
	tlsCfg.NextProtos = []string{"h2", "http/1.1"} // as the broker's listener (server.withALPN)
	errLog := log.New(os.Stderr, "bareissuer: ", log.LstdFlags)
	mux := http.NewServeMux()
	mux.Handle("POST /v1/kubeconfigs", &issuer{client: client})
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: server.DefaultReadHeaderTimeout,
		ReadTimeout:       server.DefaultReadTimeout,
		WriteTimeout:      server.DefaultWriteTimeout,
		IdleTimeout:       server.DefaultIdleTimeout,
		MaxHeaderBytes:    server.DefaultMaxHeaderBytes,
		ErrorLog:          errLog,
	}
	return baselinesrv.Serve(ctx, srv, tls.NewListener(ln, tlsCfg))
}

// issuer answers POST /v1/kubeconfigs with the direct pair's two calls:
// a Secret, then a token of the request's ServiceAccount bound to it.
type issuer struct {
	client kubernetes.Interface
}

func (i *issuer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var req apiv1.KubeconfigRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, server.DefaultMaxBodyBytes)).Decode(&req); err != nil {
		http.Error(w, "body: "+err.Error(), http.StatusBadRequest)
		return
	}
	if req.Namespace == "" || req.ServiceAccount == "" {
		http.Error(w, "namespace and serviceAccount are required", http.StatusBadRequest)
		return
	}
	seconds := int64(600)
	if req.TTL != "" {
		ttl, err := time.ParseDuration(req.TTL)
		if err != nil || ttl < 10*time.Minute {
			http.Error(w, "ttl: a duration of 10m or more", http.StatusBadRequest)
			return
		}
		seconds = int64(ttl / time.Second)
	}
	ctx := r.Context()
	s, err := i.client.CoreV1().Secrets(req.Namespace).Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "bare-", Labels: map[string]string{"bench": "bareissuer"}},
	}, metav1.CreateOptions{})
	if err != nil {
		http.Error(w, "create Secret: "+err.Error(), http.StatusBadGateway)
		return
	}
	tr, err := i.client.CoreV1().ServiceAccounts(req.Namespace).CreateToken(ctx, req.ServiceAccount, &authnv1.TokenRequest{Spec: authnv1.TokenRequestSpec{
		ExpirationSeconds: &seconds,
		BoundObjectRef:    &authnv1.BoundObjectReference{Kind: "Secret", APIVersion: "v1", Name: s.Name, UID: s.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		http.Error(w, "TokenRequest: "+err.Error(), http.StatusBadGateway)
		return
	}
	w.Header().Set("Content-Type", apiv1.MediaTypeJSON)
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(apiv1.KubeconfigResponse{
		Credential: apiv1.CredentialToken,
		Token:      tr.Status.Token,
		ExpiresAt:  tr.Status.ExpirationTimestamp.UTC(),
	})
}
