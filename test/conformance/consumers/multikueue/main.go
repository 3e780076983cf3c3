// Command multikueue runs Kueue v0.17.0's own controllers against one
// cluster, the way Kueue's integration tests do
// (test/integration/multikueue/suite_test.go: managerSetup and
// managerAndMultiKueueSetup), for the MultiKueue end-to-end test in
// test/e2e/multikueue_test.go.
//
// With --role worker it runs Kueue's core controllers, the scheduler and
// the batch/v1 Job integration: the worker admits the Workload MultiKueue
// creates there and unsuspends the Job copy. With --role manager it runs
// the same plus MultiKueue's controllers and dispatcher, which read the
// kubeconfig of each MultiKueueCluster from a Secret in Kueue's namespace
// (or, with the feature gate MultiKueueClusterProfile in the config file,
// build it from a ClusterProfile and a credentials provider) and dispatch
// Workloads to the worker with it.
//
// What is not run: Kueue's webhooks (the harness has no way to call back
// into the test process, and they only default and validate: the test
// creates its Jobs as the Job webhook would leave them, suspended and
// spec.managedBy kueue.x-k8s.io/multikueue), the visibility server, the
// metrics server and leader election. The configuration is read with
// Kueue's own loader (pkg/config.Load) from --config.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"go.uber.org/zap/zapcore"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	"k8s.io/apimachinery/pkg/util/sets"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/ptr"
	inventoryv1alpha1 "sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	configapi "sigs.k8s.io/kueue/apis/config/v1beta2"
	kueue "sigs.k8s.io/kueue/apis/kueue/v1beta2"
	qcache "sigs.k8s.io/kueue/pkg/cache/queue"
	schdcache "sigs.k8s.io/kueue/pkg/cache/scheduler"
	"sigs.k8s.io/kueue/pkg/config"
	"sigs.k8s.io/kueue/pkg/constants"
	"sigs.k8s.io/kueue/pkg/controller/admissionchecks/multikueue"
	"sigs.k8s.io/kueue/pkg/controller/core"
	"sigs.k8s.io/kueue/pkg/controller/core/indexer"
	"sigs.k8s.io/kueue/pkg/controller/jobframework"
	workloadjob "sigs.k8s.io/kueue/pkg/controller/jobs/job"
	dispatcher "sigs.k8s.io/kueue/pkg/controller/workloaddispatcher"
	"sigs.k8s.io/kueue/pkg/scheduler"
	preemptexpectations "sigs.k8s.io/kueue/pkg/scheduler/preemption/expectations"
)

func main() {
	// A flag set of its own: controller-runtime registers --kubeconfig on
	// the global one.
	fs := flag.NewFlagSet("multikueue", flag.ExitOnError)
	var (
		kubeconfig = fs.String("kubeconfig", "", "the cluster Kueue runs in (admin kubeconfig of a harness cluster)")
		role       = fs.String("role", "", "manager (core, scheduler, Job integration, MultiKueue) or worker (core, scheduler, Job integration)")
		configFile = fs.String("config", "", "a Kueue Configuration (config.kueue.x-k8s.io/v1beta2), read with Kueue's loader; empty for its defaults")
	)
	_ = fs.Parse(os.Args[1:])
	ctrl.SetLogger(zap.New(zap.Level(zapcore.InfoLevel)))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *kubeconfig, *role, *configFile); err != nil {
		fmt.Fprintln(os.Stderr, "multikueue:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, kubeconfig, role, configFile string) error {
	if role != "manager" && role != "worker" {
		return fmt.Errorf("--role must be manager or worker, not %q", role)
	}
	scheme := runtime.NewScheme()
	utilruntime.Must(clientgoscheme.AddToScheme(scheme))
	utilruntime.Must(kueue.AddToScheme(scheme))
	utilruntime.Must(configapi.AddToScheme(scheme))
	utilruntime.Must(inventoryv1alpha1.AddToScheme(scheme))

	options, cfg, err := config.Load(scheme, configFile)
	if err != nil {
		return fmt.Errorf("load the Kueue configuration: %w", err)
	}
	if err := utilfeature.DefaultMutableFeatureGate.SetFromMap(cfg.FeatureGates); err != nil {
		return fmt.Errorf("feature gates: %w", err)
	}
	restCfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}
	options.Metrics = metricsserver.Options{BindAddress: "0"}
	options.HealthProbeBindAddress = "0"
	options.LeaderElection = false
	options.WebhookServer = nil
	if role == "manager" && cfg.MultiKueue != nil && cfg.MultiKueue.ClusterProfile != nil {
		if err := config.ConfigureClusterProfileCache(ctx, ctrl.Log, &options, restCfg, cfg); err != nil {
			return fmt.Errorf("ClusterProfile cache: %w", err)
		}
	}
	mgr, err := ctrl.NewManager(restCfg, options)
	if err != nil {
		return fmt.Errorf("new manager: %w", err)
	}

	// cmd/kueue/main.go's setup, trimmed to what the Job integration needs.
	cCache := schdcache.New(mgr.GetClient())
	requeuer := qcache.NewRequeuer(qcache.WithBatchPeriod(100 * time.Millisecond))
	if err := mgr.Add(requeuer); err != nil {
		return err
	}
	expectations := preemptexpectations.New()
	queues := qcache.NewManager(mgr.GetClient(), cCache, requeuer, qcache.WithPreemptionExpectations(expectations))
	if err := indexer.Setup(ctx, mgr.GetFieldIndexer()); err != nil {
		return fmt.Errorf("indexes: %w", err)
	}
	if err := workloadjob.SetupIndexes(ctx, mgr.GetFieldIndexer()); err != nil {
		return fmt.Errorf("job indexes: %w", err)
	}
	if failed, err := core.SetupControllers(mgr, queues, cCache, &cfg, nil, expectations, nil); err != nil {
		return fmt.Errorf("core controller %s: %w", failed, err)
	}
	jobReconciler, err := workloadjob.NewReconciler(ctx, mgr.GetClient(), mgr.GetFieldIndexer(), mgr.GetEventRecorderFor(constants.JobControllerName),
		jobframework.WithCache(cCache), jobframework.WithQueues(queues))
	if err != nil {
		return fmt.Errorf("job reconciler: %w", err)
	}
	if err := jobReconciler.SetupWithManager(mgr); err != nil {
		return fmt.Errorf("job reconciler: %w", err)
	}
	if role == "manager" {
		if err := multikueue.SetupIndexer(ctx, mgr.GetFieldIndexer(), *cfg.Namespace); err != nil {
			return fmt.Errorf("multikueue indexes: %w", err)
		}
		adapters, err := jobframework.GetMultiKueueAdapters(sets.New("batch/job"))
		if err != nil {
			return fmt.Errorf("multikueue adapters: %w", err)
		}
		if err := multikueue.SetupControllers(mgr, *cfg.Namespace,
			multikueue.WithGCInterval(cfg.MultiKueue.GCInterval.Duration),
			multikueue.WithOrigin(ptr.Deref(cfg.MultiKueue.Origin, configapi.DefaultMultiKueueOrigin)),
			multikueue.WithWorkerLostTimeout(cfg.MultiKueue.WorkerLostTimeout.Duration),
			multikueue.WithEventsBatchPeriod(100*time.Millisecond),
			multikueue.WithAdapters(adapters),
			multikueue.WithDispatcherName(ptr.Deref(cfg.MultiKueue.DispatcherName, configapi.MultiKueueDispatcherModeAllAtOnce)),
			multikueue.WithClusterProfiles(cfg.MultiKueue.ClusterProfile),
		); err != nil {
			return fmt.Errorf("multikueue controllers: %w", err)
		}
		if failed, err := dispatcher.SetupControllers(mgr, &cfg, nil); err != nil {
			return fmt.Errorf("dispatcher %s: %w", failed, err)
		}
	}
	if err := mgr.Add(scheduler.New(queues, cCache, mgr.GetClient(), mgr.GetEventRecorderFor(constants.AdmissionName),
		scheduler.WithPreemptionExpectations(expectations))); err != nil {
		return fmt.Errorf("scheduler: %w", err)
	}
	go queues.CleanUpOnContext(ctx)
	go cCache.CleanUpOnContext(ctx)
	ctrl.Log.Info("starting Kueue", "role", role, "namespace", *cfg.Namespace)
	return mgr.Start(ctx)
}
